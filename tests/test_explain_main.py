"""explain_main.py --config: the model train_main would build from a run config file (its
model section and overrides), not the zoo preset of the same name, and its quantization."""

import _entry
from _train_helpers import run_config

from zoo.layers import quant


def test_config_flag_explains_the_configured_model():
    proc = _entry.explain(
        [
            "--config=configs/tiny.py",
            "--config.model.num_layers=3",
            "--config.model.quantization=int8",
            "--strategies=dp",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = run_config({"model.num_layers": 3}).model.decoder_config().describe()
    assert proc.stdout.splitlines()[0] == want
    assert "L=3 M=128" in want  # configs/tiny.py's width, not the preset's
    # The quantization the override chose, and that it keeps no scaling state to checkpoint.
    assert proc.stdout.splitlines()[1] == f"quantization: {quant.describe('int8')}"
    assert "int8 operands" in proc.stdout and "nothing extra in the checkpoint" in proc.stdout

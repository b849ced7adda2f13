"""Abstract TPU and GPU devices by target name (nnx_zoo/planning/targets.py)."""

import pytest

from nnx_zoo.planning import TargetError, target_devices, target_platform


@pytest.mark.tpu_compile
def test_v5p_2x2x2_is_eight_tpu_v5p_chips():
    devices = target_devices("v5p:2x2x2")
    assert len(devices) == 8
    assert {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {"TPU v5"}
    assert target_platform("v5p:2x2x2") == "tpu"


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    ("name", "count", "kind"),
    [
        ("h100:8", 8, "NVIDIA H100 80GB HBM3"),
        ("h200:8", 8, "NVIDIA H200"),
        ("h100:2x8", 16, "NVIDIA H100 80GB HBM3"),
    ],
)
def test_gpu_targets_come_from_the_shipped_target_configs(name, count, kind):
    devices = target_devices(name)
    assert len(devices) == count
    assert {d.device_kind for d in devices} == {kind}
    # Two hosts of eight: the devices say which process (host) drives them.
    assert len({d.process_index for d in devices}) == count // 8
    assert target_platform(name) == "gpu"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("a100:8", "unknown target 'a100:8'"),
        ("v5p", "unknown target 'v5p'"),
        ("v4:2x2x2", "TPU generation 'v4'"),
        ("h100:9", "a host holds 1 to 8 GPUs"),
        ("h100:0", "a host holds 1 to 8 GPUs"),
    ],
)
def test_bad_target_names_say_what_is_valid_in_one_line(name, says):
    with pytest.raises(TargetError) as e:
        target_platform(name)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert "v5p:2x2x2" in str(e.value) or "h100:8" in str(e.value)


@pytest.mark.tpu_compile
def test_a_topology_libtpu_cannot_lay_out_is_one_line():
    with pytest.raises(TargetError, match=r"cannot build target 'v5p:3x3x3'.*valid e\.g\.") as e:
        target_devices("v5p:3x3x3")
    assert "\n" not in str(e.value)


def test_a_missing_extra_names_the_pip_line(monkeypatch):
    import importlib.util

    from nnx_zoo.planning import targets

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith(("libtpu", "jax_plugins")) else real(name, *a),
    )
    targets._devices.cache_clear()
    try:
        with pytest.raises(TargetError, match=r'pip install -e "\.\[tpu\]"'):
            target_devices("v5p:2x2x2")
        with pytest.raises(TargetError, match=r'pip install -e "\.\[gpu\]"'):
            target_devices("h100:8")
    finally:
        targets._devices.cache_clear()

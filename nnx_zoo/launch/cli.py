"""The command line every entry point shares, written once: the start-up preamble (with the
simulated CPU devices a flag asks for), the run flags (`--config`,
`--config.<section>.<field>=value`, `--sharding_strategy`, `--mesh_shape`, `--attention_impl`,
`--workdir`, `--init_from`, `--peak_tflops`, the process flags), flag parsing, and the
one-line usage error (exit 2).

train_main and plan_main define the same run flags here (`define_run_flags`), so a train_main
command line, pasted into plan_main, plans exactly the run it would start; eval_main and
serve_main load a checkpoint by the same flags (`define_load_flags`), and every entry point
writes the rest of its flags as a table (`define_flags`). Import this module, and call
`preamble()`, before anything imports jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import types

EXIT_USAGE = 2
# configs/ sits beside this package at the top level (checkout and wheel alike).
_CONFIGS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs"
)
DEFAULT_CONFIG = os.path.join(_CONFIGS_DIR, "tiny.py")


def preamble(*, huge_pages: bool = True, cpu_flags: bool = True, cpu_only: bool = False) -> None:
    """Before jax is imported, in an entry point's own process: XLA's C++ logs at WARNING and
    up (TF_CPP_MIN_LOG_LEVEL, unless set); our XLA CPU flags (ZOO_XLA_CPU_FLAGS=1,
    nnx_zoo/runtime/xla_cpu.py) and huge pages (ZOO_HUGE_PAGES=1,
    nnx_zoo/runtime/cpu_memory.py) when the user asks for them; and (`cpu_only`: plan_main,
    explain_main, data_main, which compile for abstract targets or none) the CPU backend
    unless JAX_PLATFORMS says otherwise, so a plan never takes the accelerator a run is
    using. The platform is JAX's choice otherwise (nnx_zoo/runtime/host.py); what the native
    libraries still print at start-up: docs/performance.md, "Start-up"."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if cpu_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # libtpu, loaded to compile for a TPU target, may be held by a run on this host.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if huge_pages and (program.endswith("_main.py") or program.startswith("zoo-")):
        # glibc reads its tunables when a process starts: restart now (before anything
        # heavy is loaded) when the user asked for huge pages. Only an entry point's own
        # process: anything else importing it (a test runner) would be started again.
        from nnx_zoo.runtime.cpu_memory import reexec_with_huge_pages

        reexec_with_huge_pages()
    if cpu_flags:
        from nnx_zoo.runtime.xla_cpu import set_cpu_flags

        set_cpu_flags()  # ZOO_XLA_CPU_FLAGS=1 only; a flag already in XLA_FLAGS wins


def simulate_cpu_devices(flag: str, count_of=lambda value: value, default=None) -> None:
    """Before jax starts (XLA creates its host devices then, and a --config file may import
    jax while the flags are parsed): ask XLA for the CPU devices that `--<flag>=VALUE` on the
    command line names, `count_of(VALUE)` of them (None: none asked for). A value that is no
    count is left for the flag parser to refuse."""
    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"--{flag}=")]
    value = given[-1] if given else default  # absl's rule: the last one wins
    count = count_of(value) if value is not None else None
    if count is not None and str(count).isdigit():
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        )


def usage_error(message) -> None:
    """One line on stderr, exit status 2: for every mistake in what the user gave us."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def device_hint(error: Exception) -> str:
    """The error's text, plus how to simulate devices when a mesh asked for more devices than
    a CPU host has (the usual first stumble on a laptop)."""
    import jax

    text = str(error)
    wanted = re.search(r"needs (\d+) devices but (\d+) are available", text)
    if wanted and int(wanted.group(1)) > int(wanted.group(2)) and jax.default_backend() == "cpu":
        n = wanted.group(1)
        text += (
            f"; on CPU, simulate {n} devices by starting with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return text


def no_arguments(argv) -> None:
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}; flags look like --name=value")


@contextlib.contextmanager
def quiet_logging():
    """absl at WARNING for the length of an entry point's run unless --verbosity was given
    (Orbax logs every save, optax notes a constant schedule, at INFO; stderr is for the
    progress bar and errors); the previous verbosity is put back after. Decorates each entry
    point's `main` (`@cli.quiet_logging()`), so a run called in-process leaves absl as it
    found it."""
    from absl import flags, logging

    if flags.FLAGS["verbosity"].present:
        yield
        return
    before = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)
    try:
        yield
    finally:
        logging.set_verbosity(before)


_HELP = ("-h", "--help", "--helpshort", "--helpfull", "-help")


def new_flags():
    """An entry point's own flags. Each entry point keeps its flags apart from absl's global
    FLAGS (and from the other entry points'), so several of them can be imported and run in
    one process (a notebook, the tests) with no flag defined twice; absl's --verbosity is
    shared into it."""
    from absl import flags, logging  # noqa: F401 -- logging defines --verbosity

    flag_values = flags.FlagValues()
    flag_values["verbosity"] = flags.FLAGS["verbosity"]
    return flag_values


def run_main(main, flag_values, *, doc: str, argv: list[str] | None = None) -> None:
    """Parse `argv` (default sys.argv) into the entry point's `flag_values` and run
    `main(rest)` as absl.app.run does; `--help` prints `doc` and the flags, exit status 0.
    The console scripts call this through each entry point's `run()`."""
    from absl import app

    argv = list(sys.argv if argv is None else argv)
    if any(a in _HELP for a in argv[1:]):
        print(doc.strip() + "\n\nflags:\n" + _flags_help(flag_values), flush=True)
        sys.exit(0)

    def parse(args):
        from nnx_zoo.runtime import absl_flags

        rest = parse_flags(args, flag_values)
        # Libraries (Grain's workers) read absl's global flags; app.run wants them parsed.
        absl_flags.mark_parsed()
        return rest

    app.run(_guarded(main), argv=argv, flags_parser=parse)


def _guarded(main):
    """`main` with the two kinds of failure told apart: a mistake in the input
    (`UsageError`) is one line and exit 2; anything else keeps its traceback, says it is not
    the input's fault, and exits 1."""
    from nnx_zoo.errors import UsageError, report_internal

    def guarded(rest):
        try:
            return main(rest)
        except UsageError as e:
            usage_error(device_hint(e))
        except Exception as e:  # noqa: BLE001 -- reported whole, then exit 1
            report_internal(e)
            sys.exit(1)

    return guarded


def _flags_help(flag_values) -> str:
    lines = []
    defined = {f for group in flag_values.flags_by_module_dict().values() for f in group}
    for flag in sorted(defined | {flag_values["verbosity"]}, key=lambda f: f.name):
        default = "" if flag.default is None else f" (default: {flag.default_as_str})"
        lines.append(f"  --{flag.name}: {' '.join(str(flag.help).split())}{default}")
    return "\n".join(lines)


def parse_flags(argv, flag_values):
    from absl import flags

    try:
        return flag_values(argv)
    except flags.Error as e:
        usage_error(e)
    except Exception as e:  # noqa: BLE001 -- the --config file (any error in it) or an override
        usage_error(_unknown_field_message(e) or config_file_message(e))


# --- flag tables -----------------------------------------------------------------------------

# A table row's kind -> the absl definer (list: comma-separated strings); a tuple kind is an
# enum's values.
_DEFINE = {
    str: "DEFINE_string",
    int: "DEFINE_integer",
    float: "DEFINE_float",
    bool: "DEFINE_bool",
    list: "DEFINE_list",
}


class FlagTable(types.SimpleNamespace):
    """An entry point's flag holders by name (`table.step.value`)."""

    def values(self, *names: str) -> dict[str, object]:
        """The parsed values of the flags `names`, by name: the keyword arguments of a request
        whose fields are named as its flags are."""
        return {name: getattr(self, name).value for name in names}


def define_flags(flag_values, *rows: tuple) -> FlagTable:
    """Flags from a table, one `(name, kind, default, help)` row each, defined in the entry
    point's `flag_values`; kind is str, int, float, bool, list (comma-separated strings), or a
    tuple of the values an enum takes."""
    from absl import flags

    holders = {}
    for name, kind, default, help_text in rows:
        if isinstance(kind, tuple):
            holders[name] = flags.DEFINE_enum(
                name, default, list(kind), help_text, flag_values=flag_values
            )
        else:
            define = getattr(flags, _DEFINE[kind])
            holders[name] = define(name, default, help_text, flag_values=flag_values)
    return FlagTable(**holders)


STEP = ("step", int, None, "Checkpoint step; default: the latest complete one.")
TOKENIZER = (
    "tokenizer",
    str,
    None,
    "'byte', tokenizer.json or .model; default: the run's (or the HF dir's).",
)


@dataclasses.dataclass(frozen=True)
class LoadFlags:
    """Which checkpoint eval_main and serve_main load, and how it runs here (absl flag
    holders): the runtime choices override the ones the run recorded."""

    workdir: object
    hf_checkpoint: object
    step: object
    sharding_strategy: object
    mesh_shape: object
    attention_impl: object
    tokenizer: object

    def hf_dir(self) -> str | None:
        from nnx_zoo.checkpoint.workdir import expand

        return expand(self.hf_checkpoint.value) if self.hf_checkpoint.value else None

    def overrides(self) -> dict[str, object]:
        """The runtime choices, as `EvalRequest.overrides` takes them."""
        return dict(
            strategy=self.sharding_strategy.value,
            mesh_shape=self.mesh_shape.value,
            attention_impl=self.attention_impl.value,
            tokenizer=self.tokenizer.value,
        )


def define_load_flags(flag_values, *, workdir_help: str, hf_help: str) -> LoadFlags:
    """The load flags, in the entry point's `flag_values`; `workdir_help` and `hf_help` say
    what the entry point does with the run directory and with a Hugging Face one."""
    fv = flag_values
    table = define_flags(
        fv,
        ("workdir", str, None, workdir_help),
        ("hf_checkpoint", str, None, hf_help),
        STEP,
        TOKENIZER,
    )
    return LoadFlags(
        table.workdir,
        table.hf_checkpoint,
        table.step,
        strategy_flag(fv, "; default: the run's."),
        mesh_shape_flag(fv, "the strategy's rule"),
        attention_flag(fv, "the run's"),
        table.tokenizer,
    )


# --- the run config flags --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """train_main's command line, which plan_main takes as well (absl flag holders)."""

    config: object  # the config_flags holder of the ConfigDict
    sharding_strategy: object
    mesh_shape: object
    attention_impl: object
    workdir: object
    init_from: object
    peak_tflops: object
    coordinator_address: object
    num_processes: object
    process_id: object


# What plan_main says of the flags that describe where and how train_main runs, not the step.
_PLAN_ACCEPTS = " plan_main: accepted, so a train_main command line plans as is; no effect."


def define_run_flags(flag_values, strategy_extra: str = "", *, planning: bool = False) -> RunFlags:
    """The flags that describe a run, for train_main and plan_main alike (`planning`: the help
    says what each flag does to a plan), defined in the entry point's `flag_values`."""
    from absl import flags

    fv = flag_values
    plan_note = _PLAN_ACCEPTS if planning else ""
    config = define_config_flag(fv)
    strategy = strategy_flag(fv, f"{strategy_extra}; default: config.training.sharding_strategy.")
    mesh_shape = mesh_shape_flag(fv, "config.training.mesh_shape or the strategy's rule")
    attention = attention_flag(fv, "config.model.attention_impl")
    workdir = flags.DEFINE_string(
        "workdir", None, "Run directory; default ./runs/<config name>." + plan_note, flag_values=fv
    )
    init_from = flags.DEFINE_string(
        "init_from",
        None,
        "A Hugging Face checkpoint directory to start from (zoo.from_pretrained): its "
        "config.json sets the model's architecture, the config's model section how it runs."
        + (" plan_main plans that model." if planning else ""),
        flag_values=fv,
    )
    peak = flags.DEFINE_float(
        "peak_tflops",
        None,
        "Peak TFLOP/s per device for MFU; default: table, or measured on CPU."
        + (
            " plan_main: accepted, no effect: a plan's MFU is against the target chip's "
            "peak (nnx_zoo/planning/chips.py)."
            if planning
            else ""
        ),
        flag_values=fv,
    )
    coordinator = flags.DEFINE_string(
        "coordinator_address",
        None,
        "host:port of process 0, for several processes." + plan_note,
        flag_values=fv,
    )
    num_processes = flags.DEFINE_integer(
        "num_processes", None, "Processes in the run." + plan_note, flag_values=fv
    )
    process_id = flags.DEFINE_integer(
        "process_id", None, "This process's index." + plan_note, flag_values=fv
    )
    return RunFlags(
        config,
        strategy,
        mesh_shape,
        attention,
        workdir,
        init_from,
        peak,
        coordinator,
        num_processes,
        process_id,
    )


def strategy_flag(flag_values, tail: str):
    """--sharding_strategy, its help listing shardings.STRATEGIES, then `tail`."""
    from absl import flags

    from shardings import STRATEGIES

    return flags.DEFINE_string(
        "sharding_strategy", None, f"{' | '.join(STRATEGIES)}{tail}", flag_values=flag_values
    )


def mesh_shape_flag(flag_values, default: str):
    from absl import flags

    return flags.DEFINE_string(
        "mesh_shape", None, f"e.g. data:4,model:2; default: {default}.", flag_values=flag_values
    )


def attention_flag(flag_values, default: str):
    """--attention_impl: one of the implementations the attention registry serves."""
    from absl import flags

    from zoo.layers.attention import IMPLEMENTATIONS

    return flags.DEFINE_enum(
        "attention_impl",
        None,
        list(IMPLEMENTATIONS),
        "Attention backend (splash: TPU, cudnn: NVIDIA GPU, auto: the platform's); default: "
        f"{default}. A backend that cannot run here is an error.",
        flag_values=flag_values,
    )


def explicit_config_overrides(config_flag) -> dict[str, object]:
    """`--config.<path>=value` overrides given on the command line: dotted path -> the typed
    value config_flags parsed (so `1e-3` is a float where the field is one)."""
    holder = config_flag.value
    out = {}
    for arg in sys.argv[1:]:
        if not arg.startswith("--config."):
            continue
        path = arg.split("=", 1)[0].removeprefix("--config.")
        value = holder
        for key in path.split("."):
            value = value[key]
        out[path] = value
    return out


def config_file_given() -> bool:
    return any(a.startswith("--config=") for a in sys.argv[1:])


def load_config(config_flag, *, notes: list | None = None):
    """The typed run config of a `define_config_flag` holder: the config file with the
    command line's `--config.*` overrides (a file that does not load: one line, exit 2).

    Its warnings are printed (process 0), or appended to `notes` for the caller to `warn`
    later: a run of several processes reads its config before `jax.distributed.initialize`
    (which takes the config's timeouts), and nothing may ask for the process index before.
    A bad field raises UsageError (one line)."""
    from nnx_zoo.training.config import RunConfig

    try:
        # config_flags defers a failed load of the file to the first use of the config.
        raw = config_flag.value
        if hasattr(raw, "to_dict"):  # a get_config() returning another type is named
            raw = raw.to_dict()
    except Exception as e:  # noqa: BLE001 -- any error in the file: one line, exit 2
        usage_error(config_file_message(e))
    found: list[str] = []
    run = RunConfig.from_config_dict(raw, found)
    if notes is None:
        from nnx_zoo.runtime.console import warn

        for note in found:
            warn(note)
    else:
        notes += found
    return run


def load_run_config(run_flags: RunFlags, *, notes: list | None = None):
    """`load_config` with the run flags (--sharding_strategy, --mesh_shape, --attention_impl)
    folded in."""
    run = load_config(run_flags.config, notes=notes)
    replace = dataclasses.replace
    if run_flags.sharding_strategy.value is not None:
        run = replace(
            run,
            training=replace(run.training, sharding_strategy=run_flags.sharding_strategy.value),
        )
    if run_flags.mesh_shape.value is not None:
        run = replace(run, training=replace(run.training, mesh_shape=run_flags.mesh_shape.value))
    if run_flags.attention_impl.value is not None:
        run = replace(run, model=replace(run.model, attention_impl=run_flags.attention_impl.value))
    return run


def _resolve_config_path(value: str) -> str:
    """`~` expanded (the shell does not, after `=`); a shipped config found by name (`tiny`,
    `llama3_8b`) or by the checkout path the docs use (`configs/tiny.py`) from any directory,
    so installed entry points find their configs; an existing file wins
    (nnx_zoo/launch/config_files.py)."""
    from nnx_zoo.launch.config_files import config_path

    return config_path(value)


_CONFIG_HELP = (
    "Run config: a configs/*.py file (a get_config() module), or a shipped config's name "
    "(tiny, small, llama3_1b, llama3_8b)."
)


def define_config_flag(
    flag_values, default: str | None = DEFAULT_CONFIG, help_text: str = _CONFIG_HELP
):
    """--config, and its `--config.<section>.<field>=value` overrides (ml_collections)."""
    from ml_collections import config_flags

    # config_flags applies `--config.<path>=value` overrides while defining the flag (it reads
    # sys.argv), so a misspelt field raises here, before absl parses anything.
    sys.argv[1:] = [
        f"--config={_resolve_config_path(a.split('=', 1)[1])}" if a.startswith("--config=") else a
        for a in sys.argv[1:]
    ]
    # config_flags loads the file as the module `config_config` with the deprecated
    # `load_module()`, which runs the source in a module of that name already in sys.modules:
    # a second run in one process (a notebook, the tests) whose file defines no get_config(),
    # or is not Python, would silently take the first run's get_config().
    sys.modules.pop("config_config", None)
    try:
        return config_flags.DEFINE_config_file(
            "config", default, help_text, flag_values=flag_values, lock_config=True
        )
    except Exception as e:  # noqa: BLE001 -- a misspelt override, or any error in the file
        usage_error(_unknown_field_message(e) or config_file_message(e))


def _unknown_field_message(error: Exception) -> str | None:
    """One line for a `--config.<path>` override naming a field the config does not define
    (ml_collections raises a KeyError, sometimes wrapped, whose text spans lines), naming the
    valid fields; None when `error` is something else."""
    from nnx_zoo.training.config import SECTIONS, section_fields

    text = str(error).replace("\\'", "'").replace("\\n", "\n")
    quoted = re.search(r"'([A-Za-z_]\w*)'", text)
    if quoted is None:
        return None
    name = quoted.group(1)
    overrides = [a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--config.")]
    paths = [o.removeprefix("--config.").split(".") for o in overrides]
    path = next((p for p in paths if name in p), None)
    if path is None:
        return None
    where = path[: path.index(name)]
    if not where:
        valid = ", ".join(("name", *SECTIONS))
    elif where[0] in SECTIONS and len(where) == 1:
        valid = ", ".join(section_fields(where[0]))
    else:
        valid = None
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    hint = f"; did you mean {suggestion.group(1)!r}?" if suggestion else ""
    section = ".".join(where) or "the config"
    listing = f" (valid in {section}: {valid})" if valid else ""
    return f"--config.{'.'.join(path)}: no such config field {name!r}{hint}{listing}"


def config_file_message(error: Exception) -> str:
    """One line for a --config file that did not load (nnx_zoo/training/config_file.py)."""
    from nnx_zoo.launch.config_files import names
    from nnx_zoo.training.config_file import load_error_message

    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
    path = given[-1] if given else DEFAULT_CONFIG
    message = load_error_message(error, path)
    if not os.path.exists(path.partition(":")[0]):  # a typo'd name: say which ones exist
        message += f"; shipped configs: {', '.join(names())}, or a path to a config file"
    return message

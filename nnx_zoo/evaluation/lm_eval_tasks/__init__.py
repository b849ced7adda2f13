"""Example lm-evaluation-harness tasks on hand-written text, shipped with the package.

`eval_main.py --tasks=zoo_facts,zoo_prose --include_path=lm_eval_tasks` finds this directory
from any working directory, installed or in a checkout (nnx_zoo/evaluation/harness.py's
`include_dir`). The harness reads the YAML files here and each task's data through
`utils.load`; nothing here is imported by the package itself.
"""

"""Building a run, and the command line around it.

- `launch.cli`: the flags, the one-line usage error and the start-up preamble every entry
  point shares (import it before jax: it imports nothing heavy at module level);
- `launch.build`: one assembly of a run (the model planned once by `plan_run`, then model,
  optimizer, step, run info), concrete or abstract, for train_main, eval_main, plan_main
  and the benches;
- `launch.data`: the run's tokenizer and batches;
- `launch.session`: what train_main runs (prepare, resume, train);
- `launch.resume`: what a resumed run keeps from the run that wrote its checkpoint (the
  learning-rate schedule; the data position, when the stream is the same).

Nothing is imported here, so `from nnx_zoo.launch import cli` stays light.
"""

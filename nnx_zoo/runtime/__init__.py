"""Process start-up, before and around `import jax`: quiet native libraries (`host`), CPU
allocator and XLA flags (`cpu_memory`, `xla_cpu`), several processes (`distributed`, and
`peers`: a lost one ends the others with one line), preemption signals (`preemption`), what
a process prints (`console`: process 0's lines, errors cut to one line) and files a crash
never leaves half-written (`files`).
Entry points call these first; nothing here imports a model, a strategy or the training step.
"""

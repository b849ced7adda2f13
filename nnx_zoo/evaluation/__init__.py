"""What eval_main.py runs: settings from a run's record, the model from its checkpoint (or a
Hugging Face directory), the held-out metrics, and the record written to eval.json."""

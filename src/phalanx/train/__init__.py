"""Worker side: distributed init and the worker SDK, the model zoo, parallelization, the training loop."""

"""Training: Estimator, train_and_evaluate, the worker loop, the chief, and checkpoints."""

"""DeepSpeed engines: building them, the model and optim wrappers, optimizers."""

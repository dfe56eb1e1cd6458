"""Retrofitting a trained model to a smaller KV cache: the fit, the refinement, the latent, and the workflow
around them (uptraining by distillation through the training loop)."""

"""fusepatch inside the training stacks people use: transformers' loading and Trainer, TRL."""

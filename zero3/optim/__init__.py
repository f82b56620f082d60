"""The optimizer side: the user's ``torch.optim`` over shards with fp32 masters (`optimizer`),
mixed precision and loss scaling (`precision`), and DeepSpeed's learning-rate schedules
(`schedulers`)."""

"""ml-collections configs: one file per recipe (`--config=configs/NAME.py[:variant]`)."""

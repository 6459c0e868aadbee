"""One module per command. Modules import torch (and the engine) only inside the command body."""

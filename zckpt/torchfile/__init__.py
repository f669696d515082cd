"""The ``torch.save`` container, read and written: the zip archive, the restricted unpickler, the pickler."""

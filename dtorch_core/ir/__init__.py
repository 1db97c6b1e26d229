"""The instruction stream that the controller sends and the workers execute."""

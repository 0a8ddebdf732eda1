"""phalanx: train any PyTorch model on one device, many devices or many machines from a YAML config."""
__version__ = "0.1.0"

"""The multi-institution Flower example of chaos-flwr."""

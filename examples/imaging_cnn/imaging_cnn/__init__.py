"""The imaging CNN example of chaos-flwr: institutions, a 25 MB CNN, FedProx."""

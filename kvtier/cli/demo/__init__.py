"""The demo workload and the local model it runs on."""

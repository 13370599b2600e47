"""Metrics of generated samples that training callbacks and the commands share."""

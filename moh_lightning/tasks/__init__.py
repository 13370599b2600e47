"""One LightningModule per task; each adds beta * the MoH load-balance loss to its task loss."""

"""LightningDataModules for the tasks."""

"""Plain ``nn.Module`` models (no Lightning): each puts ``MoHAttention`` into a standard architecture."""

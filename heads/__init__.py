"""The drafters as plain nn.Modules, the vocab map, and save / load / export in each engine's format."""

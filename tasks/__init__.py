"""The built-in tasks: the toy (a tiny model on arithmetic, with and without a tool) and SmolLM2-135M end to end."""

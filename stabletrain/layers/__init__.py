"""Components shared by the model families; each chosen by name from config."""

"""Training the shipped presets (scripts/train_preset.py): the seeded agent corpus (corpus.py) and the
training loop, its loss weights and evaluations (train.py). Not part of the serving runtime: model/,
actors/, cluster/ and deploy/ never import it (tests/test_architecture.py)."""

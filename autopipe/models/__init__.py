from .transformer import SeedTransformer, seed_transformer

"""Building blocks shared by the model families: norms, rotary embeddings, attention dispatch."""

"""rudax.checkpoint: not yet built; its public names arrive with their issue (README's roadmap)."""

__all__: list[str] = []

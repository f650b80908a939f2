"""rudax.kernels: not yet built; its public names arrive with their issue (see README's roadmap)."""

__all__: list[str] = []

"""The deploy: pyinfra operations (operations/) and facts (facts/), thin over the core, and the
`@deploy` that calls them in order (converge.converge_host)."""

from sparkform.deploy.converge import converge_host

__all__ = ["converge_host"]

"""The deploy file `sparkform deploy-path` names: `pyinfra INVENTORY "$(sparkform deploy-path)"`."""

from sparkform.deploy import converge_host

converge_host()

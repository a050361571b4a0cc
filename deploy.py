"""Converge one Spark (or the sandbox): `pyinfra inventory/spark.py deploy.py [--dry --diff]`.

The packaged deploy, sparkform.deploy.converge_host (pyinfra's `@deploy`), does the work; a deploy
file of one's own can call it too, and `pyinfra INVENTORY sparkform.deploy.converge_host` runs it
by import path.
"""

from sparkform.deploy import converge_host

converge_host()

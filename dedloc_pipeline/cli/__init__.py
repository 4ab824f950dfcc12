"""``dedloc``: the command line of organizers and volunteers, one module for each side's commands
and one for those that report on a run; ``common`` reports every failure in one line."""

from . import data, organizer, reports, volunteer  # noqa: F401  (each registers its commands on the app)
from .common import app

__all__ = ["app"]

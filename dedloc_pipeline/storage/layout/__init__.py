"""Bucket keys of one run. Every key the project writes is spelled here, and every key it reads
back from a listing is parsed here, so the layout can change in one place.

Numbering: state ``s`` is what the parameters are after ``s`` optimizer steps; round ``r`` is the
batch of gradients computed against state ``r``, and committing it makes state ``r + 1``.
"""

from .data import DataLayout
from .names import LAYOUT_VERSION, PEER_ID, is_name, name_problem, volunteer_of
from .run import RunLayout
from .volunteers import Written

__all__ = ["LAYOUT_VERSION", "PEER_ID", "DataLayout", "RunLayout", "Written", "is_name", "name_problem",
           "volunteer_of"]

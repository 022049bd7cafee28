"""runspool: a client of the runspool supervisor daemon, through its files.

    from runspool import Client
    c = Client()
    run_id = c.submit(["make", "test"])
    print(c.wait(run_id).state)
"""

from .client import ACTIVE_STATES, Client, Status, default_root
from .errors import NotFound, Rejected, RunspoolError, WaitTimeout

__all__ = [
    "ACTIVE_STATES",
    "Client",
    "NotFound",
    "Rejected",
    "RunspoolError",
    "Status",
    "WaitTimeout",
    "default_root",
]
__version__ = "0.1.0"

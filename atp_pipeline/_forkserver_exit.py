"""Imported by the ranks' fork server only (:data:`atp_pipeline.launch.PRELOAD`): the server
leaves with ``os._exit`` once its launcher has gone, instead of tearing down the torch and
Lightning it preloaded (seconds of interpreter shutdown, during which it still holds the
launcher's stdout). Its forked ranks exit through multiprocessing's own ``os._exit`` and
never run this."""

import atexit
import os

atexit.register(os._exit, 0)

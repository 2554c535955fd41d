"""ppmedia's own run of the example plugin's tests: the plugin is not installed here, so its folder
goes on ``sys.path`` (an installed plugin needs nothing of this). Its tests name it in
``ppmedia_kit.family(..., plugins=[...])``, which registers its hooks here and in parity workers."""

import pathlib
import sys

PLUGIN_ROOT = str(pathlib.Path(__file__).resolve().parent)
if PLUGIN_ROOT not in sys.path:
    sys.path.insert(0, PLUGIN_ROOT)

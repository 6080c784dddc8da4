# Lets `python3 -m pytest clients/python` import the package without installing it.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

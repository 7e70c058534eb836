"""Shim for tools that need a setup.py; all metadata lives in setup.cfg."""
from setuptools import setup

setup()

"""Helpers every app may use: nothing here imports an app or `ugent_site`.

The apps share code through this package instead of importing `ugent_site` (which wires the apps
together and so stands above them) or each other sideways.
"""

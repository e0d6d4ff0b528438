"""The ``iserve`` command line."""

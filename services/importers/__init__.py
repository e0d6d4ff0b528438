"""Importers: turn measurements published by other systems into iserve's plain records."""

"""Importers: turn measurements published by other systems into iserve's plain records."""

# The most rows one model's profile holds after an import: every estimate reads the whole
# profile, and the published MaverIQ data set has under 5,000 rows for five models together.
MAX_PROFILE_MEASUREMENTS = 20_000

"""The knobs, one typed section per concern (shared/config.py says how sections become
service configs, flags, variables and docs/flags.md)."""

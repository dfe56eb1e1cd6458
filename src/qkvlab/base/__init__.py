"""What every room may use: settings, files and folders, errors, units, devices, load and measured choices.
No model, no torch modules."""

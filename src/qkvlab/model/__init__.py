"""The model core: the scheme table (spec), attention, positions, blocks, the config, accounting, the KV cache,
initialisation and model folders. Every other room reads it; it reads only qkvlab.base."""

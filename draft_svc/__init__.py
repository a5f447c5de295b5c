"""The draft pool: draft decoders that propose candidates, merged into one token tree per step."""

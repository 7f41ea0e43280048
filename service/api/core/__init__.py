"""What every API shares: the generation's output as typed events, whatever the wire format."""

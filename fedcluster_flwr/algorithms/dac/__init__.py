"""DAC (Zec et al.): similarity-weighted gossip through the server as relay; PENS (Onoszko et al.)
and the random and oracle gossip baselines."""

from .pens import PENS
from .strategy import DAC, DACVar, OracleGossip, RandomGossip

__all__ = ['DAC', 'PENS', 'DACVar', 'OracleGossip', 'RandomGossip']

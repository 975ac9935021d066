"""molt.rollout"""

"""molt.agents"""

"""molt.algo"""

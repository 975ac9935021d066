"""molt.trainer"""

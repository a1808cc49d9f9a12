import streamlit as st

st.title("monitor")
st.info("This page is not built yet.")

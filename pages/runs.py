import streamlit as st

st.title("runs")
st.info("This page is not built yet.")
